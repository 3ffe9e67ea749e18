"""Keras' PyTorch backend: its global step, with gradient hooks that hand buckets over during backprop."""
