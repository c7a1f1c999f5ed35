"""Sizes the runtime tests share (imported, not a conftest: a conftest imported as a module would load twice)."""

PIPELINED_MEMORY = 1_400_000
"""bytes per GPU: tiny-gpt then needs 2-3 nodes per pipeline (see the planner's memory model)"""
