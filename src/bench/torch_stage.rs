//! Trial runs of one pipeline stage (validate); see `validate`.
