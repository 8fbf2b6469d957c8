"""How a step's values travel between processes: one module per medium, and the choice of them."""
