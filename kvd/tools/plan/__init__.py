"""`kvd plan`: the planner's output rendered as text or JSON (`render`, `hybrid_render`)."""
