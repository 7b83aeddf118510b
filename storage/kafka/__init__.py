"""Kafka's wire protocol, sans-IO: frames, the served APIs' schemas, record batch v2 and its
conversion to and from Strata's columnar batch, compression, error codes.

The agents' Kafka listener (``broker_agents/kafka``) is framing plus this codec in front of
the same request core as the native protocol; ``docs/kafka.md`` says what is served.
"""
