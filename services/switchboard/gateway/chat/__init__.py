"""Chat messages -> prompt text: the checkpoint's chat template, rendered like transformers."""
