"""Parses Prometheus text from stdin with the Python prometheus_client parsers (the Prometheus
text format's and, the crate writing OpenMetrics text, the stricter OpenMetrics one), and prints
every sample as JSON: a list of [name, labels, value]. A parse error exits non-zero."""

import json
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics
from prometheus_client.parser import text_string_to_metric_families as prometheus

text = sys.stdin.read()
strict = [(s.name, s.labels, s.value) for f in openmetrics(text) for s in f.samples]
plain = [(s.name, s.labels, s.value) for f in prometheus(text) for s in f.samples]
if sorted(map(repr, strict)) != sorted(map(repr, plain)):
    sys.exit("the two parsers read different samples:\n%r\n%r" % (strict, plain))
json.dump(plain, sys.stdout)
