"""Hybrid models (attention groups beside Mamba/SSM state): the plan over KV-cache groups
(`plan`), Mamba state (`mamba`, `mamba_layout`), their descriptors (`layout`) and the
assembly of a hybrid pull (`assembly`). Pure, like the rest of the planner."""
