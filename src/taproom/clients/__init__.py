"""Python clients for every protocol taproom speaks, mirroring servers/ module by module."""
