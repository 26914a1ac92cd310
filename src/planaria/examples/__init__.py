"""Example specs: ``mlp`` (small and fast, for tests) and ``tiny_gpt`` (a character-level GPT)."""
