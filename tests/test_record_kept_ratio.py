"""The record states each method's mean kept ratio once, for the app's table, its export and the benchmarks."""
from prefixkv_core.report.events import MethodEvent
from prefixkv_core.policies import role_methods
from prefixkv_core.report.record import ComparisonRecord, mean_kept_ratio


def test_mean_kept_ratio_is_the_layers_mean_share_of_the_full_length():
    assert mean_kept_ratio([4, 2], 8) == 0.375
    assert mean_kept_ratio([], 8) is None and mean_kept_ratio([4], 0) is None


def test_the_record_exposes_it_per_method():
    record = ComparisonRecord(["full", "h2o"], {"full": "Full", "h2o": "H2O"}, "Hi", 0.5, roles=role_methods())
    assert record.mean_kept_ratio("h2o") is None  # no telemetry yet
    record.apply(MethodEvent("h2o", "H2O", "token", step=1, kept_per_layer=[6, 2], full_len=8))
    record.apply(MethodEvent("full", "Full", "token", step=1, kept_per_layer=[8, 8], full_len=8))
    methods = record.to_dict()["methods"]
    assert record.mean_kept_ratio("h2o") == methods["h2o"]["mean_kept_ratio"] == 0.5
    assert methods["full"]["mean_kept_ratio"] == 1.0
