"""The `zeroshard` command line and the built-in demo (trainer, corpus, GPT model, report, plots)."""
