"""The agents' Kafka listener: a codec (``codec.py``) and request handlers (``apis.py``,
``admin.py``) in front of the same request core as the native listener. ``docs/kafka.md``."""
