"""The entry points: the replicated flow (``replicated``), Hugging Face saves and their patch, replicated
torch objects, and ``atomic_open`` (one file, no rank logic)."""
