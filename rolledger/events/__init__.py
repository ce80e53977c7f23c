"""The log: msgpack codec, Redis Streams event store, consumer groups, dead letters, embedded Redis."""
