"""Built-in tasks beyond the byte-level GPT, named like a user's (`--task demonet.tasks.hf:causal_lm`).

Each lives in its own module and is imported only when a run names it, so its optional dependencies
(`transformers` for `hf`) are needed only then.
"""
