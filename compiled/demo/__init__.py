"""Small trained demo models shipped with the package (the embedded default).

Built reproducibly by build.py; see README.md here for what they do."""
