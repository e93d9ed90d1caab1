"""The Gradio app: figures (pure), handlers (generators), ui (layout and wiring), state (run files)."""
