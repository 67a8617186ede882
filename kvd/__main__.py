from kvd.cli import app

app()
