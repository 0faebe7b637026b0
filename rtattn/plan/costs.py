"""The planner's cost model and split rules (integers, so ties and loads are exact); read by
every path of Planner.plan (inspector: numpy; small: plain Python for small batches; tile_table:
prefill tiles as the columns of one table).

Cost of an item: COST_ALPHA * query_tokens + COST_BETA * kv_tokens + COST_GAMMA (the unit is
one KV token; rtattn.plan.inspector's docstring says why these values)."""

COST_ALPHA = 4
COST_BETA = 1
COST_GAMMA = 64
AUTO_IMBALANCE = 1.06  # mode "auto": slowest CTA / mean load above which contiguous is tried
MIN_CHUNK_TOKENS = 128
TAIL_FRACTION = 8      # a tile's last chunk of <= L / TAIL_FRACTION tokens joins the one before
# Planner(queue_order="request") keeps LPT's assignment when its own heaviest CTA weighs more than
# this times LPT's (rtattn.plan.order; docs/perf-log.md "prefill queue order").
QUEUE_ORDER_SLACK = 1.02
