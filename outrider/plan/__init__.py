"""The planner: a cost model of decode, verify and draft steps for any model, GPU and link
(`outrider plan`, docs/plan.md). Plain data in and out; nothing here imports torch."""
