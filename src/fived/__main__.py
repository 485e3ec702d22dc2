from fived.cli.main import console

console()
