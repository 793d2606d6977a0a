"""The endpoints, by kind: text (chat and completions), images, and operations (models,
stats, metrics, health, the page)."""
