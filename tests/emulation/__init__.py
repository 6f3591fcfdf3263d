"""CPU emulations of device operators, written from their documentation. Tests only."""
