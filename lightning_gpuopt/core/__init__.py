"""Measuring and deciding: torch + standard library (psutil for host facts), no Lightning import.

Each module here can be used and unit-tested without a ``Trainer``; the callbacks in
:mod:`lightning_gpuopt.callbacks` are thin adapters over it.
"""
