"""Broker agents: the network server, partition leadership, replication, tiering, control."""
