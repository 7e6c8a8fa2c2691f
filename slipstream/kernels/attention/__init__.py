"""Paged attention, rotary embedding and KV-cache writes, and the L2 weight prefetch that rides
in the decode attention launch."""
