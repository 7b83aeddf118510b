"""Lambda-style handlers (``handler(event, context)``): admin API, scheduler, retry router."""
