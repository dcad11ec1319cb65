"""The built-in demo: `zeroshard train` and `zeroshard compare` (trainer, corpus, report, plots)."""
