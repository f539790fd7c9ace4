"""The weight circuits: factored matrices, QK/OV circuits, copying, composition, virtual weights."""
