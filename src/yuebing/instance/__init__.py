"""Serving instances: the engine on the KV pool (roles prefill, decode, coupled), their control
server and the Conductor's client (`InstanceClient`)."""
