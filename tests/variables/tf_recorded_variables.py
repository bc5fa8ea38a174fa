"""Values recorded from TensorFlow 2.21 (tensorflow-cpu, MirroredStrategy on 2 and 4
logical CPUs) by a side script, hard-coded here: after each update of a variable
[1, 2] in each context, the components (one list per replica) or the error raised.

In replica context replica r gives (r + 1) * [10, 20]; in cross-replica context the
value is [5, 7]. Keys: "SYNC/DTYPE/AGGREGATION/CONTEXT/OP", plus "/cross_read" (the
value read in cross-replica context after a replica-context update) and "/create".
Errors are kept as "ERR <type>: <TensorFlow's message>".
"""

TF_2_REPLICAS = {'ON_WRITE/float32/NONE/replica/assign': [[10.0, 20.0], [20.0, 40.0]],
 'ON_WRITE/float32/NONE/replica/assign/cross_read': [10.0, 20.0],
 'ON_WRITE/float32/NONE/cross/assign': [[5.0, 7.0], [5.0, 7.0]],
 'ON_WRITE/float32/NONE/replica/assign_add': [[11.0, 22.0], [21.0, 42.0]],
 'ON_WRITE/float32/NONE/replica/assign_add/cross_read': [11.0, 22.0],
 'ON_WRITE/float32/NONE/cross/assign_add': [[6.0, 9.0], [6.0, 9.0]],
 'ON_WRITE/float32/NONE/replica/assign_sub': [[-9.0, -18.0], [-19.0, -38.0]],
 'ON_WRITE/float32/NONE/replica/assign_sub/cross_read': [-9.0, -18.0],
 'ON_WRITE/float32/NONE/cross/assign_sub': [[-4.0, -5.0], [-4.0, -5.0]],
 'ON_WRITE/float32/SUM/replica/assign': [[30.0, 60.0], [30.0, 60.0]],
 'ON_WRITE/float32/SUM/replica/assign/cross_read': [30.0, 60.0],
 'ON_WRITE/float32/SUM/cross/assign': [[5.0, 7.0], [5.0, 7.0]],
 'ON_WRITE/float32/SUM/replica/assign_add': [[31.0, 62.0], [31.0, 62.0]],
 'ON_WRITE/float32/SUM/replica/assign_add/cross_read': [31.0, 62.0],
 'ON_WRITE/float32/SUM/cross/assign_add': [[6.0, 9.0], [6.0, 9.0]],
 'ON_WRITE/float32/SUM/replica/assign_sub': [[-29.0, -58.0], [-29.0, -58.0]],
 'ON_WRITE/float32/SUM/replica/assign_sub/cross_read': [-29.0, -58.0],
 'ON_WRITE/float32/SUM/cross/assign_sub': [[-4.0, -5.0], [-4.0, -5.0]],
 'ON_WRITE/float32/MEAN/replica/assign': [[15.0, 30.0], [15.0, 30.0]],
 'ON_WRITE/float32/MEAN/replica/assign/cross_read': [15.0, 30.0],
 'ON_WRITE/float32/MEAN/cross/assign': [[5.0, 7.0], [5.0, 7.0]],
 'ON_WRITE/float32/MEAN/replica/assign_add': [[16.0, 32.0], [16.0, 32.0]],
 'ON_WRITE/float32/MEAN/replica/assign_add/cross_read': [16.0, 32.0],
 'ON_WRITE/float32/MEAN/cross/assign_add': [[6.0, 9.0], [6.0, 9.0]],
 'ON_WRITE/float32/MEAN/replica/assign_sub': [[-14.0, -28.0], [-14.0, -28.0]],
 'ON_WRITE/float32/MEAN/replica/assign_sub/cross_read': [-14.0, -28.0],
 'ON_WRITE/float32/MEAN/cross/assign_sub': [[-4.0, -5.0], [-4.0, -5.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign': [[10.0, 20.0], [10.0, 20.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign/cross_read': [10.0, 20.0],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/cross/assign': [[5.0, 7.0], [5.0, 7.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign_add': [[11.0, 22.0], [11.0, 22.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign_add/cross_read': [11.0, 22.0],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/cross/assign_add': [[6.0, 9.0], [6.0, 9.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign_sub': [[-9.0, -18.0], [-9.0, -18.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign_sub/cross_read': [-9.0, -18.0],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/cross/assign_sub': [[-4.0, -5.0], [-4.0, -5.0]],
 'ON_WRITE/int32/NONE/replica/assign': [[10, 20], [20, 40]],
 'ON_WRITE/int32/NONE/replica/assign/cross_read': [10, 20],
 'ON_WRITE/int32/NONE/cross/assign': [[5, 7], [5, 7]],
 'ON_WRITE/int32/NONE/replica/assign_add': [[11, 22], [21, 42]],
 'ON_WRITE/int32/NONE/replica/assign_add/cross_read': [11, 22],
 'ON_WRITE/int32/NONE/cross/assign_add': [[6, 9], [6, 9]],
 'ON_WRITE/int32/NONE/replica/assign_sub': [[-9, -18], [-19, -38]],
 'ON_WRITE/int32/NONE/replica/assign_sub/cross_read': [-9, -18],
 'ON_WRITE/int32/NONE/cross/assign_sub': [[-4, -5], [-4, -5]],
 'ON_WRITE/int32/SUM/replica/assign': [[30, 60], [30, 60]],
 'ON_WRITE/int32/SUM/replica/assign/cross_read': [30, 60],
 'ON_WRITE/int32/SUM/cross/assign': [[5, 7], [5, 7]],
 'ON_WRITE/int32/SUM/replica/assign_add': [[31, 62], [31, 62]],
 'ON_WRITE/int32/SUM/replica/assign_add/cross_read': [31, 62],
 'ON_WRITE/int32/SUM/cross/assign_add': [[6, 9], [6, 9]],
 'ON_WRITE/int32/SUM/replica/assign_sub': [[-29, -58], [-29, -58]],
 'ON_WRITE/int32/SUM/replica/assign_sub/cross_read': [-29, -58],
 'ON_WRITE/int32/SUM/cross/assign_sub': [[-4, -5], [-4, -5]],
 'ON_WRITE/int32/MEAN/create': 'ERR ValueError: creating distributed tf.Variable with '
                               'aggregation=MEAN and a non-floating dtype is not '
                               'supported, please use a different aggregation or dtype',
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign': [[10, 20], [10, 20]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign/cross_read': [10, 20],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/cross/assign': [[5, 7], [5, 7]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign_add': [[11, 22], [11, 22]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign_add/cross_read': [11, 22],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/cross/assign_add': [[6, 9], [6, 9]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign_sub': [[-9, -18], [-9, -18]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign_sub/cross_read': [-9, -18],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/cross/assign_sub': [[-4, -5], [-4, -5]],
 'ON_READ/float32/NONE/replica/assign': [[10.0, 20.0], [20.0, 40.0]],
 'ON_READ/float32/NONE/replica/assign/cross_read': 'ERR ValueError: Could not convert from '
                                                   '`tf.VariableAggregation` '
                                                   'VariableAggregationV2.NONE '
                                                   'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/cross/assign': 'ERR ValueError: Could not convert from '
                                      '`tf.VariableAggregation` VariableAggregationV2.NONE '
                                      'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/replica/assign_add': [[11.0, 22.0], [21.0, 42.0]],
 'ON_READ/float32/NONE/replica/assign_add/cross_read': 'ERR ValueError: Could not convert '
                                                       'from `tf.VariableAggregation` '
                                                       'VariableAggregationV2.NONE '
                                                       'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/cross/assign_add': 'ERR ValueError: Could not convert from '
                                          '`tf.VariableAggregation` '
                                          'VariableAggregationV2.NONE '
                                          'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/replica/assign_sub': [[-9.0, -18.0], [-19.0, -38.0]],
 'ON_READ/float32/NONE/replica/assign_sub/cross_read': 'ERR ValueError: Could not convert '
                                                       'from `tf.VariableAggregation` '
                                                       'VariableAggregationV2.NONE '
                                                       'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/cross/assign_sub': 'ERR ValueError: Could not convert from '
                                          '`tf.VariableAggregation` '
                                          'VariableAggregationV2.NONE '
                                          'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/SUM/replica/assign': [[10.0, 20.0], [20.0, 40.0]],
 'ON_READ/float32/SUM/replica/assign/cross_read': [30.0, 60.0],
 'ON_READ/float32/SUM/cross/assign': [[2.5, 3.5], [2.5, 3.5]],
 'ON_READ/float32/SUM/replica/assign_add': [[11.0, 22.0], [21.0, 42.0]],
 'ON_READ/float32/SUM/replica/assign_add/cross_read': [32.0, 64.0],
 'ON_READ/float32/SUM/cross/assign_add': 'ERR ValueError: SyncOnReadVariable does not '
                                         'support `assign_add` in cross-replica context '
                                         'when aggregation is set to '
                                         '`tf.VariableAggregation.SUM`.',
 'ON_READ/float32/SUM/replica/assign_sub': [[-9.0, -18.0], [-19.0, -38.0]],
 'ON_READ/float32/SUM/replica/assign_sub/cross_read': [-28.0, -56.0],
 'ON_READ/float32/SUM/cross/assign_sub': 'ERR ValueError: SyncOnReadVariable does not '
                                         'support `assign_sub` in cross-replica context '
                                         'when aggregation is set to '
                                         '`tf.VariableAggregation.SUM`.',
 'ON_READ/float32/MEAN/replica/assign': [[10.0, 20.0], [20.0, 40.0]],
 'ON_READ/float32/MEAN/replica/assign/cross_read': [15.0, 30.0],
 'ON_READ/float32/MEAN/cross/assign': [[5.0, 7.0], [5.0, 7.0]],
 'ON_READ/float32/MEAN/replica/assign_add': [[11.0, 22.0], [21.0, 42.0]],
 'ON_READ/float32/MEAN/replica/assign_add/cross_read': [16.0, 32.0],
 'ON_READ/float32/MEAN/cross/assign_add': [[6.0, 9.0], [6.0, 9.0]],
 'ON_READ/float32/MEAN/replica/assign_sub': [[-9.0, -18.0], [-19.0, -38.0]],
 'ON_READ/float32/MEAN/replica/assign_sub/cross_read': [-14.0, -28.0],
 'ON_READ/float32/MEAN/cross/assign_sub': [[-4.0, -5.0], [-4.0, -5.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign': [[10.0, 20.0], [20.0, 40.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign/cross_read': [10.0, 20.0],
 'ON_READ/float32/ONLY_FIRST_REPLICA/cross/assign': [[5.0, 7.0], [5.0, 7.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign_add': [[11.0, 22.0], [21.0, 42.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign_add/cross_read': [11.0, 22.0],
 'ON_READ/float32/ONLY_FIRST_REPLICA/cross/assign_add': [[6.0, 9.0], [6.0, 9.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign_sub': [[-9.0, -18.0], [-19.0, -38.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign_sub/cross_read': [-9.0, -18.0],
 'ON_READ/float32/ONLY_FIRST_REPLICA/cross/assign_sub': [[-4.0, -5.0], [-4.0, -5.0]],
 'ON_READ/int32/NONE/replica/assign': [[10, 20], [20, 40]],
 'ON_READ/int32/NONE/replica/assign/cross_read': 'ERR ValueError: Could not convert from '
                                                 '`tf.VariableAggregation` '
                                                 'VariableAggregationV2.NONE '
                                                 'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/cross/assign': 'ERR ValueError: Could not convert from '
                                    '`tf.VariableAggregation` VariableAggregationV2.NONE '
                                    'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/replica/assign_add': [[11, 22], [21, 42]],
 'ON_READ/int32/NONE/replica/assign_add/cross_read': 'ERR ValueError: Could not convert '
                                                     'from `tf.VariableAggregation` '
                                                     'VariableAggregationV2.NONE '
                                                     'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/cross/assign_add': 'ERR ValueError: Could not convert from '
                                        '`tf.VariableAggregation` '
                                        'VariableAggregationV2.NONE '
                                        'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/replica/assign_sub': [[-9, -18], [-19, -38]],
 'ON_READ/int32/NONE/replica/assign_sub/cross_read': 'ERR ValueError: Could not convert '
                                                     'from `tf.VariableAggregation` '
                                                     'VariableAggregationV2.NONE '
                                                     'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/cross/assign_sub': 'ERR ValueError: Could not convert from '
                                        '`tf.VariableAggregation` '
                                        'VariableAggregationV2.NONE '
                                        'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/SUM/replica/assign': [[10, 20], [20, 40]],
 'ON_READ/int32/SUM/replica/assign/cross_read': [30, 60],
 'ON_READ/int32/SUM/cross/assign': [[2, 3], [2, 3]],
 'ON_READ/int32/SUM/replica/assign_add': [[11, 22], [21, 42]],
 'ON_READ/int32/SUM/replica/assign_add/cross_read': [32, 64],
 'ON_READ/int32/SUM/cross/assign_add': 'ERR ValueError: SyncOnReadVariable does not '
                                       'support `assign_add` in cross-replica context when '
                                       'aggregation is set to '
                                       '`tf.VariableAggregation.SUM`.',
 'ON_READ/int32/SUM/replica/assign_sub': [[-9, -18], [-19, -38]],
 'ON_READ/int32/SUM/replica/assign_sub/cross_read': [-28, -56],
 'ON_READ/int32/SUM/cross/assign_sub': 'ERR ValueError: SyncOnReadVariable does not '
                                       'support `assign_sub` in cross-replica context when '
                                       'aggregation is set to '
                                       '`tf.VariableAggregation.SUM`.',
 'ON_READ/int32/MEAN/create': 'ERR ValueError: creating distributed tf.Variable with '
                              'aggregation=MEAN and a non-floating dtype is not supported, '
                              'please use a different aggregation or dtype',
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign': [[10, 20], [20, 40]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign/cross_read': [10, 20],
 'ON_READ/int32/ONLY_FIRST_REPLICA/cross/assign': [[5, 7], [5, 7]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign_add': [[11, 22], [21, 42]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign_add/cross_read': [11, 22],
 'ON_READ/int32/ONLY_FIRST_REPLICA/cross/assign_add': [[6, 9], [6, 9]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign_sub': [[-9, -18], [-19, -38]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign_sub/cross_read': [-9, -18],
 'ON_READ/int32/ONLY_FIRST_REPLICA/cross/assign_sub': [[-4, -5], [-4, -5]]}

TF_4_REPLICAS = {'ON_WRITE/float32/NONE/replica/assign': [[10.0, 20.0],
                                          [20.0, 40.0],
                                          [30.0, 60.0],
                                          [40.0, 80.0]],
 'ON_WRITE/float32/NONE/replica/assign/cross_read': [10.0, 20.0],
 'ON_WRITE/float32/NONE/cross/assign': [[5.0, 7.0], [5.0, 7.0], [5.0, 7.0], [5.0, 7.0]],
 'ON_WRITE/float32/NONE/replica/assign_add': [[11.0, 22.0],
                                              [21.0, 42.0],
                                              [31.0, 62.0],
                                              [41.0, 82.0]],
 'ON_WRITE/float32/NONE/replica/assign_add/cross_read': [11.0, 22.0],
 'ON_WRITE/float32/NONE/cross/assign_add': [[6.0, 9.0], [6.0, 9.0], [6.0, 9.0], [6.0, 9.0]],
 'ON_WRITE/float32/NONE/replica/assign_sub': [[-9.0, -18.0],
                                              [-19.0, -38.0],
                                              [-29.0, -58.0],
                                              [-39.0, -78.0]],
 'ON_WRITE/float32/NONE/replica/assign_sub/cross_read': [-9.0, -18.0],
 'ON_WRITE/float32/NONE/cross/assign_sub': [[-4.0, -5.0],
                                            [-4.0, -5.0],
                                            [-4.0, -5.0],
                                            [-4.0, -5.0]],
 'ON_WRITE/float32/SUM/replica/assign': [[100.0, 200.0],
                                         [100.0, 200.0],
                                         [100.0, 200.0],
                                         [100.0, 200.0]],
 'ON_WRITE/float32/SUM/replica/assign/cross_read': [100.0, 200.0],
 'ON_WRITE/float32/SUM/cross/assign': [[5.0, 7.0], [5.0, 7.0], [5.0, 7.0], [5.0, 7.0]],
 'ON_WRITE/float32/SUM/replica/assign_add': [[101.0, 202.0],
                                             [101.0, 202.0],
                                             [101.0, 202.0],
                                             [101.0, 202.0]],
 'ON_WRITE/float32/SUM/replica/assign_add/cross_read': [101.0, 202.0],
 'ON_WRITE/float32/SUM/cross/assign_add': [[6.0, 9.0], [6.0, 9.0], [6.0, 9.0], [6.0, 9.0]],
 'ON_WRITE/float32/SUM/replica/assign_sub': [[-99.0, -198.0],
                                             [-99.0, -198.0],
                                             [-99.0, -198.0],
                                             [-99.0, -198.0]],
 'ON_WRITE/float32/SUM/replica/assign_sub/cross_read': [-99.0, -198.0],
 'ON_WRITE/float32/SUM/cross/assign_sub': [[-4.0, -5.0],
                                           [-4.0, -5.0],
                                           [-4.0, -5.0],
                                           [-4.0, -5.0]],
 'ON_WRITE/float32/MEAN/replica/assign': [[25.0, 50.0],
                                          [25.0, 50.0],
                                          [25.0, 50.0],
                                          [25.0, 50.0]],
 'ON_WRITE/float32/MEAN/replica/assign/cross_read': [25.0, 50.0],
 'ON_WRITE/float32/MEAN/cross/assign': [[5.0, 7.0], [5.0, 7.0], [5.0, 7.0], [5.0, 7.0]],
 'ON_WRITE/float32/MEAN/replica/assign_add': [[26.0, 52.0],
                                              [26.0, 52.0],
                                              [26.0, 52.0],
                                              [26.0, 52.0]],
 'ON_WRITE/float32/MEAN/replica/assign_add/cross_read': [26.0, 52.0],
 'ON_WRITE/float32/MEAN/cross/assign_add': [[6.0, 9.0], [6.0, 9.0], [6.0, 9.0], [6.0, 9.0]],
 'ON_WRITE/float32/MEAN/replica/assign_sub': [[-24.0, -48.0],
                                              [-24.0, -48.0],
                                              [-24.0, -48.0],
                                              [-24.0, -48.0]],
 'ON_WRITE/float32/MEAN/replica/assign_sub/cross_read': [-24.0, -48.0],
 'ON_WRITE/float32/MEAN/cross/assign_sub': [[-4.0, -5.0],
                                            [-4.0, -5.0],
                                            [-4.0, -5.0],
                                            [-4.0, -5.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign': [[10.0, 20.0],
                                                        [10.0, 20.0],
                                                        [10.0, 20.0],
                                                        [10.0, 20.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign/cross_read': [10.0, 20.0],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/cross/assign': [[5.0, 7.0],
                                                      [5.0, 7.0],
                                                      [5.0, 7.0],
                                                      [5.0, 7.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign_add': [[11.0, 22.0],
                                                            [11.0, 22.0],
                                                            [11.0, 22.0],
                                                            [11.0, 22.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign_add/cross_read': [11.0, 22.0],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/cross/assign_add': [[6.0, 9.0],
                                                          [6.0, 9.0],
                                                          [6.0, 9.0],
                                                          [6.0, 9.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign_sub': [[-9.0, -18.0],
                                                            [-9.0, -18.0],
                                                            [-9.0, -18.0],
                                                            [-9.0, -18.0]],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/replica/assign_sub/cross_read': [-9.0, -18.0],
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/cross/assign_sub': [[-4.0, -5.0],
                                                          [-4.0, -5.0],
                                                          [-4.0, -5.0],
                                                          [-4.0, -5.0]],
 'ON_WRITE/int32/NONE/replica/assign': [[10, 20], [20, 40], [30, 60], [40, 80]],
 'ON_WRITE/int32/NONE/replica/assign/cross_read': [10, 20],
 'ON_WRITE/int32/NONE/cross/assign': [[5, 7], [5, 7], [5, 7], [5, 7]],
 'ON_WRITE/int32/NONE/replica/assign_add': [[11, 22], [21, 42], [31, 62], [41, 82]],
 'ON_WRITE/int32/NONE/replica/assign_add/cross_read': [11, 22],
 'ON_WRITE/int32/NONE/cross/assign_add': [[6, 9], [6, 9], [6, 9], [6, 9]],
 'ON_WRITE/int32/NONE/replica/assign_sub': [[-9, -18], [-19, -38], [-29, -58], [-39, -78]],
 'ON_WRITE/int32/NONE/replica/assign_sub/cross_read': [-9, -18],
 'ON_WRITE/int32/NONE/cross/assign_sub': [[-4, -5], [-4, -5], [-4, -5], [-4, -5]],
 'ON_WRITE/int32/SUM/replica/assign': [[100, 200], [100, 200], [100, 200], [100, 200]],
 'ON_WRITE/int32/SUM/replica/assign/cross_read': [100, 200],
 'ON_WRITE/int32/SUM/cross/assign': [[5, 7], [5, 7], [5, 7], [5, 7]],
 'ON_WRITE/int32/SUM/replica/assign_add': [[101, 202], [101, 202], [101, 202], [101, 202]],
 'ON_WRITE/int32/SUM/replica/assign_add/cross_read': [101, 202],
 'ON_WRITE/int32/SUM/cross/assign_add': [[6, 9], [6, 9], [6, 9], [6, 9]],
 'ON_WRITE/int32/SUM/replica/assign_sub': [[-99, -198],
                                           [-99, -198],
                                           [-99, -198],
                                           [-99, -198]],
 'ON_WRITE/int32/SUM/replica/assign_sub/cross_read': [-99, -198],
 'ON_WRITE/int32/SUM/cross/assign_sub': [[-4, -5], [-4, -5], [-4, -5], [-4, -5]],
 'ON_WRITE/int32/MEAN/create': 'ERR ValueError: creating distributed tf.Variable with '
                               'aggregation=MEAN and a non-floating dtype is not '
                               'supported, please use a different aggregation or dtype',
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign': [[10, 20],
                                                      [10, 20],
                                                      [10, 20],
                                                      [10, 20]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign/cross_read': [10, 20],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/cross/assign': [[5, 7], [5, 7], [5, 7], [5, 7]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign_add': [[11, 22],
                                                          [11, 22],
                                                          [11, 22],
                                                          [11, 22]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign_add/cross_read': [11, 22],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/cross/assign_add': [[6, 9], [6, 9], [6, 9], [6, 9]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign_sub': [[-9, -18],
                                                          [-9, -18],
                                                          [-9, -18],
                                                          [-9, -18]],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/replica/assign_sub/cross_read': [-9, -18],
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/cross/assign_sub': [[-4, -5],
                                                        [-4, -5],
                                                        [-4, -5],
                                                        [-4, -5]],
 'ON_READ/float32/NONE/replica/assign': [[10.0, 20.0],
                                         [20.0, 40.0],
                                         [30.0, 60.0],
                                         [40.0, 80.0]],
 'ON_READ/float32/NONE/replica/assign/cross_read': 'ERR ValueError: Could not convert from '
                                                   '`tf.VariableAggregation` '
                                                   'VariableAggregationV2.NONE '
                                                   'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/cross/assign': 'ERR ValueError: Could not convert from '
                                      '`tf.VariableAggregation` VariableAggregationV2.NONE '
                                      'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/replica/assign_add': [[11.0, 22.0],
                                             [21.0, 42.0],
                                             [31.0, 62.0],
                                             [41.0, 82.0]],
 'ON_READ/float32/NONE/replica/assign_add/cross_read': 'ERR ValueError: Could not convert '
                                                       'from `tf.VariableAggregation` '
                                                       'VariableAggregationV2.NONE '
                                                       'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/cross/assign_add': 'ERR ValueError: Could not convert from '
                                          '`tf.VariableAggregation` '
                                          'VariableAggregationV2.NONE '
                                          'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/replica/assign_sub': [[-9.0, -18.0],
                                             [-19.0, -38.0],
                                             [-29.0, -58.0],
                                             [-39.0, -78.0]],
 'ON_READ/float32/NONE/replica/assign_sub/cross_read': 'ERR ValueError: Could not convert '
                                                       'from `tf.VariableAggregation` '
                                                       'VariableAggregationV2.NONE '
                                                       'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/NONE/cross/assign_sub': 'ERR ValueError: Could not convert from '
                                          '`tf.VariableAggregation` '
                                          'VariableAggregationV2.NONE '
                                          'to`tf.distribute.ReduceOp` type',
 'ON_READ/float32/SUM/replica/assign': [[10.0, 20.0],
                                        [20.0, 40.0],
                                        [30.0, 60.0],
                                        [40.0, 80.0]],
 'ON_READ/float32/SUM/replica/assign/cross_read': [100.0, 200.0],
 'ON_READ/float32/SUM/cross/assign': [[1.25, 1.75],
                                      [1.25, 1.75],
                                      [1.25, 1.75],
                                      [1.25, 1.75]],
 'ON_READ/float32/SUM/replica/assign_add': [[11.0, 22.0],
                                            [21.0, 42.0],
                                            [31.0, 62.0],
                                            [41.0, 82.0]],
 'ON_READ/float32/SUM/replica/assign_add/cross_read': [104.0, 208.0],
 'ON_READ/float32/SUM/cross/assign_add': 'ERR ValueError: SyncOnReadVariable does not '
                                         'support `assign_add` in cross-replica context '
                                         'when aggregation is set to '
                                         '`tf.VariableAggregation.SUM`.',
 'ON_READ/float32/SUM/replica/assign_sub': [[-9.0, -18.0],
                                            [-19.0, -38.0],
                                            [-29.0, -58.0],
                                            [-39.0, -78.0]],
 'ON_READ/float32/SUM/replica/assign_sub/cross_read': [-96.0, -192.0],
 'ON_READ/float32/SUM/cross/assign_sub': 'ERR ValueError: SyncOnReadVariable does not '
                                         'support `assign_sub` in cross-replica context '
                                         'when aggregation is set to '
                                         '`tf.VariableAggregation.SUM`.',
 'ON_READ/float32/MEAN/replica/assign': [[10.0, 20.0],
                                         [20.0, 40.0],
                                         [30.0, 60.0],
                                         [40.0, 80.0]],
 'ON_READ/float32/MEAN/replica/assign/cross_read': [25.0, 50.0],
 'ON_READ/float32/MEAN/cross/assign': [[5.0, 7.0], [5.0, 7.0], [5.0, 7.0], [5.0, 7.0]],
 'ON_READ/float32/MEAN/replica/assign_add': [[11.0, 22.0],
                                             [21.0, 42.0],
                                             [31.0, 62.0],
                                             [41.0, 82.0]],
 'ON_READ/float32/MEAN/replica/assign_add/cross_read': [26.0, 52.0],
 'ON_READ/float32/MEAN/cross/assign_add': [[6.0, 9.0], [6.0, 9.0], [6.0, 9.0], [6.0, 9.0]],
 'ON_READ/float32/MEAN/replica/assign_sub': [[-9.0, -18.0],
                                             [-19.0, -38.0],
                                             [-29.0, -58.0],
                                             [-39.0, -78.0]],
 'ON_READ/float32/MEAN/replica/assign_sub/cross_read': [-24.0, -48.0],
 'ON_READ/float32/MEAN/cross/assign_sub': [[-4.0, -5.0],
                                           [-4.0, -5.0],
                                           [-4.0, -5.0],
                                           [-4.0, -5.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign': [[10.0, 20.0],
                                                       [20.0, 40.0],
                                                       [30.0, 60.0],
                                                       [40.0, 80.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign/cross_read': [10.0, 20.0],
 'ON_READ/float32/ONLY_FIRST_REPLICA/cross/assign': [[5.0, 7.0],
                                                     [5.0, 7.0],
                                                     [5.0, 7.0],
                                                     [5.0, 7.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign_add': [[11.0, 22.0],
                                                           [21.0, 42.0],
                                                           [31.0, 62.0],
                                                           [41.0, 82.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign_add/cross_read': [11.0, 22.0],
 'ON_READ/float32/ONLY_FIRST_REPLICA/cross/assign_add': [[6.0, 9.0],
                                                         [6.0, 9.0],
                                                         [6.0, 9.0],
                                                         [6.0, 9.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign_sub': [[-9.0, -18.0],
                                                           [-19.0, -38.0],
                                                           [-29.0, -58.0],
                                                           [-39.0, -78.0]],
 'ON_READ/float32/ONLY_FIRST_REPLICA/replica/assign_sub/cross_read': [-9.0, -18.0],
 'ON_READ/float32/ONLY_FIRST_REPLICA/cross/assign_sub': [[-4.0, -5.0],
                                                         [-4.0, -5.0],
                                                         [-4.0, -5.0],
                                                         [-4.0, -5.0]],
 'ON_READ/int32/NONE/replica/assign': [[10, 20], [20, 40], [30, 60], [40, 80]],
 'ON_READ/int32/NONE/replica/assign/cross_read': 'ERR ValueError: Could not convert from '
                                                 '`tf.VariableAggregation` '
                                                 'VariableAggregationV2.NONE '
                                                 'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/cross/assign': 'ERR ValueError: Could not convert from '
                                    '`tf.VariableAggregation` VariableAggregationV2.NONE '
                                    'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/replica/assign_add': [[11, 22], [21, 42], [31, 62], [41, 82]],
 'ON_READ/int32/NONE/replica/assign_add/cross_read': 'ERR ValueError: Could not convert '
                                                     'from `tf.VariableAggregation` '
                                                     'VariableAggregationV2.NONE '
                                                     'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/cross/assign_add': 'ERR ValueError: Could not convert from '
                                        '`tf.VariableAggregation` '
                                        'VariableAggregationV2.NONE '
                                        'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/replica/assign_sub': [[-9, -18], [-19, -38], [-29, -58], [-39, -78]],
 'ON_READ/int32/NONE/replica/assign_sub/cross_read': 'ERR ValueError: Could not convert '
                                                     'from `tf.VariableAggregation` '
                                                     'VariableAggregationV2.NONE '
                                                     'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/NONE/cross/assign_sub': 'ERR ValueError: Could not convert from '
                                        '`tf.VariableAggregation` '
                                        'VariableAggregationV2.NONE '
                                        'to`tf.distribute.ReduceOp` type',
 'ON_READ/int32/SUM/replica/assign': [[10, 20], [20, 40], [30, 60], [40, 80]],
 'ON_READ/int32/SUM/replica/assign/cross_read': [100, 200],
 'ON_READ/int32/SUM/cross/assign': [[1, 1], [1, 1], [1, 1], [1, 1]],
 'ON_READ/int32/SUM/replica/assign_add': [[11, 22], [21, 42], [31, 62], [41, 82]],
 'ON_READ/int32/SUM/replica/assign_add/cross_read': [104, 208],
 'ON_READ/int32/SUM/cross/assign_add': 'ERR ValueError: SyncOnReadVariable does not '
                                       'support `assign_add` in cross-replica context when '
                                       'aggregation is set to '
                                       '`tf.VariableAggregation.SUM`.',
 'ON_READ/int32/SUM/replica/assign_sub': [[-9, -18], [-19, -38], [-29, -58], [-39, -78]],
 'ON_READ/int32/SUM/replica/assign_sub/cross_read': [-96, -192],
 'ON_READ/int32/SUM/cross/assign_sub': 'ERR ValueError: SyncOnReadVariable does not '
                                       'support `assign_sub` in cross-replica context when '
                                       'aggregation is set to '
                                       '`tf.VariableAggregation.SUM`.',
 'ON_READ/int32/MEAN/create': 'ERR ValueError: creating distributed tf.Variable with '
                              'aggregation=MEAN and a non-floating dtype is not supported, '
                              'please use a different aggregation or dtype',
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign': [[10, 20],
                                                     [20, 40],
                                                     [30, 60],
                                                     [40, 80]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign/cross_read': [10, 20],
 'ON_READ/int32/ONLY_FIRST_REPLICA/cross/assign': [[5, 7], [5, 7], [5, 7], [5, 7]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign_add': [[11, 22],
                                                         [21, 42],
                                                         [31, 62],
                                                         [41, 82]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign_add/cross_read': [11, 22],
 'ON_READ/int32/ONLY_FIRST_REPLICA/cross/assign_add': [[6, 9], [6, 9], [6, 9], [6, 9]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign_sub': [[-9, -18],
                                                         [-19, -38],
                                                         [-29, -58],
                                                         [-39, -78]],
 'ON_READ/int32/ONLY_FIRST_REPLICA/replica/assign_sub/cross_read': [-9, -18],
 'ON_READ/int32/ONLY_FIRST_REPLICA/cross/assign_sub': [[-4, -5],
                                                       [-4, -5],
                                                       [-4, -5],
                                                       [-4, -5]]}

TF_OTHER = {'ON_WRITE/float32/NONE/trainable': True,
 'ON_WRITE/float32/SUM/trainable': True,
 'ON_WRITE/float32/MEAN/trainable': True,
 'ON_WRITE/float32/ONLY_FIRST_REPLICA/trainable': True,
 'ON_WRITE/int32/NONE/trainable': True,
 'ON_WRITE/int32/SUM/trainable': True,
 'ON_WRITE/int32/ONLY_FIRST_REPLICA/trainable': True,
 'ON_READ/float32/NONE/trainable': False,
 'ON_READ/float32/SUM/trainable': False,
 'ON_READ/float32/MEAN/trainable': False,
 'ON_READ/float32/ONLY_FIRST_REPLICA/trainable': False,
 'ON_READ/int32/NONE/trainable': False,
 'ON_READ/int32/SUM/trainable': False,
 'ON_READ/int32/ONLY_FIRST_REPLICA/trainable': False,
 'create/sync_none': 'ERR ValueError: `NONE` variable synchronization mode is not '
                     'supported with tf.distribute strategy. Please change the '
                     '`synchronization` for variable: None',
 'create/onread_trainable': ['SyncOnReadVariable',
                             True,
                             "<dtype: 'float32'>",
                             'ON_READ',
                             'NONE'],
 'create/auto_default': ['MirroredVariable',
                         True,
                         "<dtype: 'float32'>",
                         'ON_WRITE',
                         'NONE'],
 'dtype/pyfloat': 'float32',
 'dtype/pyint': 'int32',
 'dtype/np64': 'float64',
 'dtype/list': 'int32',
 'bad/shape': "ERR ValueError: Cannot assign value to variable ' Variable:0': Shape "
              'mismatch.The variable shape (2,), and the assigned value shape (3,) are '
              'incompatible.',
 'bad/broadcast': "ERR ValueError: Cannot assign value to variable ' Variable:0': Shape "
                  'mismatch.The variable shape (2,), and the assigned value shape () are '
                  'incompatible.',
 'bad/float_into_int': 'ERR TypeError: Cannot convert [1.5, 2.5] to EagerTensor of dtype '
                       'int32',
 'bad/int_into_float': [[1.0, 2.0], [1.0, 2.0], [1, 2], [1, 2]]}

# TensorFlow 2.21 (tensorflow-cpu) on the programs Keras users' loops run: a
# MirroredStrategy on 2 logical CPUs unless named. Recorded by record_tf_loops.py
# (tensorflow-cpu 2.21.0, 2026-12-03; ``--check`` compares a new run with these).
TF_LOOPS = {
    # v = tf.Variable(10.0, aggregation=SUM) in the scope; strategy.run(lambda:
    # v.assign_add(2.0)): the same Python value on every replica.
    "mirrored/SUM/replica/assign_add(2.0)":
        "ERR ValueError: A non-DistributedValues value 2.0 cannot be reduced with the "
        "given reduce op ReduceOp.SUM.",
    # OneDeviceStrategy("cpu:0"), v = tf.Variable(10.0) (aggregation NONE);
    # strategy.run(lambda: v.assign_add(2.0)).
    "one_device/NONE/replica/assign_add(2.0)": 12.0,
    # tf.nn.compute_average_loss(tf.constant([1, 2, 3]), global_batch_size=4) and, inside
    # strategy.run on 2 replicas, without global_batch_size: (dtype, value).
    "compute_average_loss/int32/global_batch_size=4": ("float64", 1.5),
    "compute_average_loss/int32/2 replicas": ("float64", 1.0),
}
