"""State beyond f failures: capturing a rank's layers, pushing them to a buddy, holding a buddy's, the
checkpoint directory, and restoring from either.

May import `train` (layer state, optimizer), `models` (Hugging Face export) and `oobleck.api`.
"""
