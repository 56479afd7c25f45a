import subengine


def test_engine_appends_and_reads(engine, orders):
    stored = engine.append(orders, [subengine.NewEvent("order-1", "OrderPlaced", {"total": 5})])
    assert [(a.position, a.key_version, a.duplicate) for a in stored] == [(1, 1, False)]
