"""The soak (issue 47): ``python -m bench soak``; its history (``history``) and checker."""
