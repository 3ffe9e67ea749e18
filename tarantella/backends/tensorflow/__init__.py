"""The TensorFlow backend: its global step (`step.py`), the ops that hand its gradient buckets to
the reducer (`gradients.py`), and its devices."""
