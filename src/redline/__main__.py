from redline.cli.entry import main

# guarded: a spawned multiprocessing child re-imports this module as __mp_main__ and must not rerun the CLI
if __name__ == "__main__":
    main()
