"""The local stack, the demo, and deploy helpers."""
