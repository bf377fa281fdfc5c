"""Building blocks shared by the models (attention operators, graph layers, glue)."""
