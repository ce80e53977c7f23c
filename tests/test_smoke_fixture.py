"""The session's redis-server is real and is not the machine's 6379."""


def test_redis_fixture_is_private(redis_client, redis_server):
    assert redis_server.port != 6379
    assert redis_client.ping()
    info = redis_client.info("server")
    assert int(info["redis_version"].split(".")[0]) >= 6
