/* c */ COMMIT -- x
