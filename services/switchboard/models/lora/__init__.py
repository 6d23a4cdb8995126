"""LoRA adapters in PEFT's format, many at once in one batch.

``adapter.py`` reads and checks an adapter directory; ``stacks.py`` holds, per projection of
the model, the resident adapters' low-rank matrices side by side and adds each row's delta
(one shrink and one expand matmul for all of them); ``manager.py`` keeps the adapters known,
their CPU copies (an LRU) and which ones sit in the resident slots.
"""
