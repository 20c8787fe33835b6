"""Test doubles for running lightning-gpuopt on machines without a GPU."""
