"""Measuring and deciding: pure torch + standard library, no Lightning import.

Each module here can be used and unit-tested without a ``Trainer``; the callbacks in
:mod:`lightning_gpuopt.callbacks` are thin adapters over it.
"""
