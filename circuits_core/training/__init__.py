"""The shipped models' training code: corpus and training loop."""
