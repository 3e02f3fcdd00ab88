"""Beyond one machine: the shards of a plan joined into one report (`merge`), and a plan's cells
run as Ray tasks (`ray_sweep`, the optional `ray` extra)."""
