"""Training apart from serving: `specd train-drafter` and `specd drafter-data` (drafter/), the
demo pair's tokenizer, models and training (demo/), and the held-out workloads that training
leaves out and the benchmarks measure on (workloads). Serving installs and images carry none of it."""
