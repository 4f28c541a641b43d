"""MoE backends: the router and the routed experts."""
