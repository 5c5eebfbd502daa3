from redline.cli.main import main

main()
