"""Example specs: ``mlp`` (small and fast, for tests) and ``tiny_gpt`` (a character-level GPT);
``hf_causal_lm``, a script: a tiny GPT-2 through the Hugging Face ``ElasticTrainer``."""
