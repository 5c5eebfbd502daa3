"""`redline submit` and `redline jobs`: a queue that shares a GPU server between jobs and people, placing each job
on GPUs with room for it, and hands the same job spec to Slurm, Ray or Kubernetes past one server."""
