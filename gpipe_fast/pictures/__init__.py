"""Pictures of a step's timeline: what they show, as PNG, SVG or a Chrome trace."""
