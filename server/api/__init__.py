"""HTTP routes and wire formats (TGI, and later OpenAI); converted to engine objects only here."""
