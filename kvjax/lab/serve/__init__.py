"""Serving: the continuous-batching engine (host scheduler, page allocator) and its device step."""
