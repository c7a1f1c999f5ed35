"""Oobleck: resilient distributed training on Kubernetes with pipeline templates."""

__version__ = "0.1.0"
