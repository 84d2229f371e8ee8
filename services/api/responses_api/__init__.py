"""OpenAI's Responses API: its bodies, its stored responses, its routes' work; answered by the answer path."""
