"""Keras' JAX backend: its global step, jitted by Keras, with its collectives as ordered callbacks."""
